"""Native kernels below the model layer: ``cpu/`` holds the C sources, their build and
load, and the checked Python entry points (``cpu.ops``). Nothing here imports
``conveyor.model``."""
