"""conveyor's benchmarks, by topic (see README.md): a package so that scripts share
``benchmarks.common`` and run from the repository root as
``python -m benchmarks.<topic>.<script>``."""
