"""The GPU check: `make gpu-bundle` here (bundle.py), `make gpu-check` on a machine with an NVIDIA GPU
(check.py, which runs the steps in steps.py). See docs/gpu-check.md."""
