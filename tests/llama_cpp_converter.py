"""llama.cpp's own HF -> GGUF converter, convert_hf_to_gguf.py, the reference for `smollm2 export --to gguf`.

It is pure Python (with the gguf-py it vendors), and ships in llama-cpp-python's source distribution; `make
install-test` runs this file, which unpacks the converter of the version pinned here into the user's cache, once:

    python tests/llama_cpp_converter.py                    # fetch (pip download), unless already there
    python tests/llama_cpp_converter.py convert DIR TYPE OUT [DIR TYPE OUT ...]

`convert` runs the converter on each HF directory, in one process (its imports take longer than a tiny model's
conversion), with its own gguf-py first on the path, as it runs itself.
"""

from __future__ import annotations

import os
import runpy
import subprocess
import sys
import tempfile
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python's, which vendors llama.cpp
CONVERTER = (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "smollm2"
             / f"llama.cpp-convert-{VERSION}")
SCRIPT = CONVERTER / "convert_hf_to_gguf.py"
PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py")  # what the converter imports


def fetch() -> None:
    if SCRIPT.exists():
        return
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        "--dest", tmp, f"llama-cpp-python=={VERSION}"], check=True)
        (archive,) = Path(tmp).glob("llama_cpp_python-*.tar.gz")
        unpacked = Path(tmp) / "converter"
        unpacked.mkdir()
        source = f"llama_cpp_python-{VERSION}/vendor/llama.cpp"
        subprocess.run(["tar", "xzf", str(archive), "-C", str(unpacked), "--strip-components=3",
                        *(f"{source}/{part}" for part in PARTS)], check=True)
        CONVERTER.parent.mkdir(parents=True, exist_ok=True)
        os.replace(unpacked, CONVERTER)  # whole or not at all
    print(f"llama.cpp's convert_hf_to_gguf.py (llama-cpp-python {VERSION}) is in {CONVERTER}")


def convert(jobs: list[str]) -> None:
    sys.path[:0] = [str(CONVERTER), str(CONVERTER / "gguf-py")]
    converter = runpy.run_path(str(SCRIPT), run_name="convert_hf_to_gguf")
    for directory, type, out in zip(jobs[::3], jobs[1::3], jobs[2::3]):
        sys.argv = [str(SCRIPT), directory, "--outtype", type, "--outfile", out]
        converter["main"]()


if __name__ == "__main__":
    if sys.argv[1:2] == ["convert"]:
        convert(sys.argv[2:])
    else:
        fetch()
