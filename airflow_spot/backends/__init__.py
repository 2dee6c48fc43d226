"""Where instances come from: ``local`` (embedded default) and, later, ``ec2``."""
from __future__ import annotations
