import os
import sys

sys.path.insert(0, os.path.dirname(__file__))

# Property tests draw the same examples on every run: a search that finds a new failing
# example only once in a while would turn CI red at random (a failure found by a local
# run with other seeds gets its own @example).
from hypothesis import settings as _hyp_settings

_hyp_settings.register_profile("conveyor", derandomize=True)
_hyp_settings.load_profile("conveyor")


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests need a CUDA device: skipped cleanly without one."""
    # The marker, not ``"gpu" in item.keywords``: keywords hold the directory names too, so
    # a checkout in a folder named gpu skipped every test.
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return
    import torch

    if torch.cuda.is_available():
        return
    import pytest

    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in marked:
        item.add_marker(skip)
