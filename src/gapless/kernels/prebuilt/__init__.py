"""Where the install puts our compiled kernels (setup.py): one module per extension and
instruction-set level of kernels/extensions.py, each with its sources' digest beside it."""
