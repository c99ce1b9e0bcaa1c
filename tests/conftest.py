import os
import sys

# the CPU is the platform: with the CUDA plugin installed (the gpu-program extra, for
# tests/test_gpu_program.py's deviceless compiles) JAX would first try, and log, a GPU
os.environ.setdefault("JAX_PLATFORMS", "cpu")

sys.path.insert(0, os.path.dirname(__file__))
