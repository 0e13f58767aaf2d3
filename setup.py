"""Build of specdec-kernels and its C++/CUDA extension ``specdec_kernels.ops._C``.

    pip install --no-build-isolation -e .     # development (extension built in place)
    pip install --no-build-isolation .        # regular install

``--no-build-isolation`` makes the build use the torch already installed, so the extension
matches its ABI.  The variant is picked like this:

- ``CUDAExtension`` (csrc/*.cpp + csrc/*.cu) when torch was built with CUDA
  (``torch.version.cuda`` set, or a GPU visible) and ``CUDA_HOME``/nvcc is found;
- ``CppExtension`` (csrc/*.cpp only) otherwise, or when ``USE_CUDA=0``.

Environment: ``USE_CUDA=0`` forces the CPU-only build, ``USE_CUDA=1`` demands the CUDA one;
``DEBUG=1`` compiles with ``-O0 -g``; ``TORCH_CUDA_ARCH_LIST`` (e.g. ``"8.0;9.0"``) picks the
GPU architectures (unset: torch uses the visible GPUs' archs, or its default list).
"""

from __future__ import annotations

import glob
import os
import re
import sys

try:
    import torch
except ImportError:  # an isolated build (pip's default) has no torch: say what to run, in one line
    sys.exit("specdec-kernels compiles its C++ extension against the torch already installed: install torch first "
             "(pip install torch), then this package with pip install --no-build-isolation .")
from setuptools import find_packages, setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def _version() -> str:
    """The one version of the package: ``__version__`` in specdec_kernels/__init__.py."""
    with open(os.path.join(HERE, "specdec_kernels", "__init__.py"), encoding="utf-8") as f:
        return re.search(r'^__version__ = "([^"]+)"', f.read(), re.M).group(1)

CSRC = "csrc"  # relative to HERE: setuptools wants relative source paths


def _env_flag(name: str) -> str | None:
    """'0', '1' or None (unset/empty) for a boolean environment switch; anything else is an error."""
    value = os.environ.get(name, "").strip()
    if value == "":
        return None
    if value.lower() in ("0", "false", "off", "no"):
        return "0"
    if value.lower() in ("1", "true", "on", "yes"):
        return "1"
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


def _use_cuda() -> bool:
    torch_has_cuda = torch.version.cuda is not None or torch.cuda.is_available()
    requested = _env_flag("USE_CUDA")
    if requested == "0":
        return False
    if requested == "1":
        if not torch_has_cuda:
            raise RuntimeError(
                f"USE_CUDA=1 but the installed torch {torch.__version__} has no CUDA "
                "(torch.version.cuda is None); install a CUDA build of torch or unset USE_CUDA"
            )
        if CUDA_HOME is None:
            raise RuntimeError(
                "USE_CUDA=1 but no CUDA toolkit was found; set CUDA_HOME or put nvcc on PATH"
            )
        return True
    return torch_has_cuda and CUDA_HOME is not None


def _openmp() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) for OpenMP, where torch's own intra-op threads are OpenMP's
    (its Linux wheels).  ``at::parallel_for`` is a header template: compiled without OpenMP it runs
    the whole range on the calling thread, so without ``-fopenmp`` ``skinny_linear`` ignored
    ``torch.set_num_threads``.  The extension links the libgomp that torch ships (``torch/lib``;
    CPU wheels name it libgomp.so.1, CUDA wheels may carry it as libgomp-<hash>.so.1): torch has
    loaded it before the extension, the soname binds to that one copy, and the process has one
    OpenMP runtime (with the system's libgomp beside a renamed one it would have two).  Without
    such a file, plain ``-fopenmp`` (the compiler's libgomp).  ``SPECDEC_OPENMP=0`` builds
    without OpenMP (one thread); only on Linux (gcc)."""
    if _env_flag("SPECDEC_OPENMP") == "0" or not sys.platform.startswith("linux"):
        return [], []  # elsewhere (Apple's clang has no -fopenmp) the loops stay on one thread
    if "OpenMP" not in torch.__config__.parallel_info().split("ATen parallel backend:")[-1]:
        return [], []
    bundled = sorted(glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*")))
    if bundled:
        return ["-fopenmp"], [bundled[0]]
    return ["-fopenmp"], ["-fopenmp"]


def _extensions() -> list:
    debug = _env_flag("DEBUG") == "1"
    use_cuda = _use_cuda()
    opt = ["-O0", "-g"] if debug else ["-O3"]
    # The sources are C++17, but no -std is passed: BuildExtension then adds the standard the
    # installed torch's headers need (C++20 for torch 2.13, whose headers use C++20 features
    # and warn under -std=c++17).

    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp"), root_dir=HERE))
    omp_compile, omp_link = _openmp()
    extra_compile_args: dict[str, list[str]] = {"cxx": list(opt) + omp_compile}
    extra_link_args = (["-g"] if debug else []) + omp_link
    if use_cuda:
        sources += sorted(glob.glob(os.path.join(CSRC, "*.cu"), root_dir=HERE))
        extra_compile_args["nvcc"] = opt + (["-lineinfo"] if debug else [])
        arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST") or (
            "unset: torch picks the visible GPUs' archs, or its default list"
        )
        print(
            f"specdec-kernels: building CUDAExtension specdec_kernels.ops._C with CUDA {torch.version.cuda} "
            f"(CUDA_HOME={CUDA_HOME}), TORCH_CUDA_ARCH_LIST={arch_list}, "
            f"{'DEBUG (-O0 -g)' if debug else 'release (-O3)'}"
        )
        extension = CUDAExtension
    else:
        why = (
            "USE_CUDA=0"
            if _env_flag("USE_CUDA") == "0"
            else f"torch.version.cuda={torch.version.cuda}, CUDA_HOME={CUDA_HOME}"
        )
        print(
            f"specdec-kernels: building CppExtension specdec_kernels.ops._C (CPU only; {why}), "
            f"{'DEBUG (-O0 -g)' if debug else 'release (-O3)'}"
        )
        extension = CppExtension

    return [
        extension(
            "specdec_kernels.ops._C",
            sources,
            include_dirs=[os.path.join(HERE, CSRC)],
            extra_compile_args=extra_compile_args,
            extra_link_args=extra_link_args,
            # Only torch/library.h and the limited Python C API (an empty module) are used,
            # so BuildExtension defines Py_LIMITED_API and one build serves CPython >= 3.10.
            py_limited_api=True,
        )
    ]


setup(
    name="specdec-kernels",
    version=_version(),
    description="Fused kernels for exact speculative decoding",
    long_description=open(os.path.join(HERE, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    license_files=["LICENSE", "NOTICE"],
    packages=find_packages(exclude=("python_tests", "python_tests.*", "bench", "bench.*")),
    # The embedded default draft (weights, config, tokenizer) ships inside the package.
    package_data={"specdec_kernels": ["assets/draft/*", "assets/feature_draft/*", "py.typed"]},
    python_requires=">=3.10",
    # By need: the op (fused_verify, fused_verify_tree, the KV ops) needs torch, and triton for its
    # GPU kernel; the decoding loop, the CLI and the integrations need transformers ([hf]).
    install_requires=[
        "torch>=2.11",
        "triton>=3.6",
        "tqdm",
        "safetensors",
        "numpy",
        "packaging",
    ],
    extras_require={
        "hf": ["transformers>=5.17,<6"],
        "bench": ["matplotlib>=3.8", "scipy>=1.11"],
        "grammar": ["xgrammar>=0.2.9,<0.3"],
        "test": ["transformers>=5.17,<6", "pytest>=8", "pytest-xdist>=3.5", "scipy>=1.11", "build>=1.2", "ruff>=0.6",
                 "xgrammar>=0.2.9,<0.3", "jsonschema>=4.20"],
        "all": ["transformers>=5.17,<6", "matplotlib>=3.8", "scipy>=1.11", "pytest>=8", "pytest-xdist>=3.5",
                "build>=1.2", "ruff>=0.6", "xgrammar>=0.2.9,<0.3", "jsonschema>=4.20"],
    },
    entry_points={
        "console_scripts": ["specdec = specdec_kernels.cli:main"],
        # vLLM calls every general plugin at start-up in each of its processes; this one swaps in
        # the fused rejection sampler only when SPECDEC_VLLM=1 (specdec_kernels/integrations/vllm.py).
        "vllm.general_plugins": ["specdec_kernels = specdec_kernels.integrations.vllm:register"],
    },
    ext_modules=_extensions(),
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
    zip_safe=False,
)
