"""The real-GPU benchmark (``python -m benchmarks gpu``), split by what each part measures;
``validate.sh`` runs it with the GPU tests in one device call (see ``README.md`` here)."""
