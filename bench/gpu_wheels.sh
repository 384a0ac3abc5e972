#!/usr/bin/env bash
# The wheels a GPU machine with JAX's image but no package registry lacks (grain with array-record and portpicker,
# tensorboardX), for CPython 3.12 on x86-64, downloaded into DIR (default .whl) on a machine that reaches PyPI; and
# FlashAttention-3's library alone (18 MB of its 78 MB CUDA 13 wheel, whose FlashAttention-2 library would not
# travel), in DIR/flash3/dew_flash_attn, where parallel/kernels/flash3.py loads it from; and tokamax with what it
# imports that the image lacks (37 MB, 32 of them xprof, which its benchmarking imports), for the experts' grouped
# matmul (parallel/grouped.py). About 60 MB in all: under the device tool's 64 MiB with the repository's 4.
# On the GPU machine, from the repository root:
#   python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl && export PYTHONPATH=/tmp/site:DIR/flash3
#   python3 bench/on_gpu.py --out /tmp/on_gpu
set -euo pipefail
dir="${1:-.whl}"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp "${platforms[@]}" -d "$dir" \
  grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 tensorboardX==2.6.5 \
  tokamax==0.0.17 xprof==2.24.2 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 jaxtyping==0.3.11 wadler-lindig==0.1.8 \
  pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 fire==0.7.1 termcolor==3.3.0 \
  six==1.17.0 colorama==0.4.6
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PYTHON_VERSION:-3.12}" \
  --implementation cp "${platforms[@]}" -d "$dir/flash3" dew-flash-attn-cu13==0.3.6
unzip -q -o -d "$dir/flash3" "$dir"/flash3/dew_flash_attn_cu13-*.whl dew_flash_attn/libdew_flash_attn3.so \
  'dew_flash_attn_cu13-*.dist-info/licenses/*'
rm "$dir"/flash3/*.whl
ls -l "$dir" "$dir/flash3/dew_flash_attn"
