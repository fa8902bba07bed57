#!/usr/bin/env python3
"""Stand-in for nvidia-cuda-mps-control in a dry run: -d starts nothing, `quit` on stdin ends nothing."""

import sys

if "-d" not in sys.argv:
    sys.stdin.read()
