"""What the reference tests (test_reference.py, test_hf_interop.py) share: NumPy and PyTorch, where they do not
import a skip line and exit 77 (meson's "skipped"); scripts/reference/llama_ref.py as L; and how a check is run
and counted."""
import os
import sys
import traceback

try:
    import numpy as np  # noqa: F401 (the tests import them from here)
    import torch  # noqa: F401
    import torch.nn.functional as F  # noqa: F401
except ImportError as e:  # counted as skipped, never as passed (exit 77: meson's "skipped")
    print(f"skipped: {e} (scripts/setup.sh installs python3-numpy and python3-torch)")
    print("0 passed, 0 failed, 1 skipped")
    sys.exit(77)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REF = os.path.join(ROOT, "scripts", "reference", "llama_ref.py")
sys.path.insert(0, os.path.dirname(REF))
import llama_ref as L  # noqa: E402,F401


class Skip(Exception):
    """A check that cannot run here: counted as skipped, never as passed."""


def run_check(counts, name, fn):
    """Runs fn() as the check `name` and prints "ok   name" (with ": " and what fn returned, when not None),
    "skip name: why" when it raises Skip, else "FAIL name" and the traceback; counts["passed"], ["skipped"] or
    ["failed"] goes up by one."""
    try:
        what = fn()
        counts["passed"] += 1
        print(f"ok   {name}" + ("" if what is None else f": {what}"))
    except Skip as e:
        counts["skipped"] += 1
        print(f"skip {name}: {e}")
    except Exception:
        counts["failed"] += 1
        print(f"FAIL {name}")
        traceback.print_exc()
    sys.stdout.flush()
