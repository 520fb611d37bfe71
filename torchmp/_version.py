"""The single source of torchmp's version (setup.py compiles it into _core)."""
__version__ = "0.1.0"
