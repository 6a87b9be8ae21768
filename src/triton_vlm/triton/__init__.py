"""The Triton adapter: the only subpackage that imports `triton_python_backend_utils`."""
