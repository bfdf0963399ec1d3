import os
import signal

# Busy-waiting OpenMP threads crawl when more ranks than cores share a loaded machine (CI here):
# measured 12-17 s vs ~1 s for 8 steps of a one-process run. Set before anything imports torch;
# every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# A suite started in the background by a shell without job control (`.ci/run &`, `nohup ... &`)
# inherits SIGINT ignored, and so would every job it launches (an ignored disposition survives exec):
# the Ctrl+C tests would then send a signal nobody can receive. A terminal's default, as users have.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

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
