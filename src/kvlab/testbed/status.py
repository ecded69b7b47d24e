"""NVMe controllers as a host's /sys/class/nvme shows them (fabrics and local alike)."""

from __future__ import annotations

# One line per controller: name|transport|address|state|subsysnqn (address on one line).
CONTROLLERS_SCRIPT = (
    'for d in /sys/class/nvme/nvme*; do [ -e "$d/transport" ] || continue; '
    'printf \'%s|%s|%s|%s|%s\\n\' "${d##*/}" "$(cat $d/transport)" '
    '"$(tr \'\\n\' \' \' < $d/address 2>/dev/null)" "$(cat $d/state)" "$(cat $d/subsysnqn)"; done'
)


def parse_address(text: str) -> dict[str, str]:
    """`traddr=10.77.0.1,trsvcid=4420,src_addr=10.77.0.2` → {"traddr": ..., ...}."""
    out: dict[str, str] = {}
    for part in text.replace(" ", ",").split(","):
        key, sep, value = part.strip().partition("=")
        if sep and key:
            out[key] = value
    return out


def parse_controllers(text: str) -> list[dict]:
    ctrls = []
    for line in text.splitlines():
        fields = line.strip().split("|")
        if len(fields) != 5:
            continue
        name, transport, address, state, subsysnqn = (f.strip() for f in fields)
        ctrls.append({
            "name": name,
            "transport": transport,
            "address": parse_address(address),
            "state": state,
            "subsysnqn": subsysnqn,
        })  # fmt: skip
    return sorted(ctrls, key=lambda c: c["name"])
