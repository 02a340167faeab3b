"""The browser front end: Jinja2 page shells (``templates/``) and their scripts, styles and icons (``static/``).

It is a package only so that it installs with simpletuner (no CDN: every asset is served by the server itself);
``simpletuner.server.routes.ui`` finds the folders through ``TEMPLATES`` and ``STATIC``.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parent
TEMPLATES = ROOT / "templates"
STATIC = ROOT / "static"
