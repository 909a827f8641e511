"""The engine behind HTTP: serving overhead, disaggregation and the router, live."""
