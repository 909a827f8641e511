"""One-off experiments: a question asked once, kept to be asked again."""
