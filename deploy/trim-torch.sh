#!/bin/sh
# Drop what torch's wheel ships for its own C++ tests (torch/test, the test binaries and protoc in torch/bin):
# ~130 MB that a server never runs. torch_shm_manager (shared-memory tensors) and everything imported stay.
set -eu
torch_dir="$(python3 -c 'import importlib.util, os; print(os.path.dirname(importlib.util.find_spec("torch").origin))')"
rm -rf "$torch_dir/test"
find "$torch_dir/bin" -maxdepth 1 -type f ! -name torch_shm_manager -delete
