"""The benchmarks package lives at the repository root, beside src/."""

import sys

from tests_support import ROOT

if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
