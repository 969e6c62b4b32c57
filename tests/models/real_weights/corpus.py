# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""The plain-English corpus the quality measurements on real weights read.

Debian's and Ubuntu's ``base-files`` ship these licence texts in
``/usr/share/common-licenses``: long prose (about 150 KB, 30K tokens of either
real model), present on most hosts and identical between them, so perplexity
and needle haystacks need no download. The order is the one every measurement
concatenates or splits them in.
"""

from pathlib import Path

LICENCE_DIR = Path("/usr/share/common-licenses")
LICENCE_TEXTS = tuple(
    str(LICENCE_DIR / name)
    for name in (
        "GPL-3",
        "GPL-2",
        "LGPL-2.1",
        "MPL-2.0",
        "Apache-2.0",
        "GFDL-1.3",
        "Artistic",
    )
)
