"""ctest's entry to one of tests/test_cpp.py's differential checks of a C++ test program (runtime/cpp/CMakeLists.txt):
runs that test on the build named by $SPECRT_CPP_BUILD, in one process; exit 77 (ctest: skipped) where this Python
cannot run the suite (no pytest, no specrt)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

missing = [m for m in ("pytest", "specrt") if importlib.util.find_spec(m) is None]
if missing:
    print(f"{sys.executable} has no {', '.join(missing)}: the Python side of the check cannot run", file=sys.stderr)
    sys.exit(77)
tests = Path(__file__).resolve().parent
sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                          str(tests / "test_cpp.py"), "-k", sys.argv[1]], cwd=tests.parent))
