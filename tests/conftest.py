import os

# Busy-waiting OpenMP threads crawl when more ranks than cores share a loaded machine (CI here):
# measured 12-17 s vs ~1 s for 8 steps of a one-process run. Set before anything imports torch;
# every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


import pytest  # noqa: E402 - after the environment above, which torch reads at import


@pytest.fixture(autouse=True)
def _environment_as_found():
    """Each test leaves ``os.environ`` as it found it: an in-process Lightning run sets variables its
    launch or ``seed_everything`` needs (``PL_GLOBAL_SEED``), and the processes a later test on the
    same worker starts inherit them (Lightning's DistributedSampler then shuffled by another seed)."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
