import os

# Busy-waiting OpenMP threads crawl when more ranks than cores share a loaded machine (CI here):
# measured 12-17 s vs ~1 s for 8 steps of a one-process run. Set before anything imports torch;
# every process the tests start inherits it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
