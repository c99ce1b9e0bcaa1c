import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # as in tests/conftest.py: the CUDA plugin may be installed

sys.path.insert(0, os.path.dirname(__file__))
