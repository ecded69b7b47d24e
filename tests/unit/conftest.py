"""The unit tier's folders mirror the packages they test (the connector's store/, worker/, io/,
lmcache_l2/; the CLI's engines/, bench/, setups/). A test may import a helper from another
test module by its name (`from test_store import put`), wherever that module sits: every
folder of the tier is on the path. Test file names stay unique across the folders."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
for folder in sorted(p for p in [HERE, *HERE.iterdir()] if p.is_dir() and not p.name.startswith((".", "_"))):
    if str(folder) not in sys.path:
        sys.path.append(str(folder))
