"""The console's page: a shell of plain HTML that holds no journal data (it is served without
the token, so a reload still loads), its style sheet and its script. Each view's HTML comes
from the API, rendered on the server (``queue``, ``delegation``, ``lists``), with the token in
a header. The one script and one style sheet are allowed by their hashes in the
Content-Security-Policy (``POLICY``): nothing else runs, no inline handler, nothing fetched
from anywhere but this server."""

import base64
import hashlib

from tether._console.script import SCRIPT
from tether._console.style import STYLE

PAGE = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>tether console</title>
<style>{STYLE}</style></head><body>
<header class="top">
<span class="brand">tether console</span>
<nav><a href="/" data-section="queue">Needs attention<span id="attention-pill" class="pill zero"
>0</span></a><a href="/delegations" data-section="delegations">Delegations</a><a href="/actions"
data-section="actions">Actions</a></nav>
<form data-nav="/delegations" role="search"><input type="text" name="q" aria-label="id or key"
placeholder="Delegation id, action id or key" data-testid="search"
autocomplete="off"><button type="submit">Go</button></form>
<span id="status">connecting...</span>
</header>
<main><div id="message" role="alert"></div><div id="view" data-testid="view"></div></main>
<script>{SCRIPT}</script></body></html>
"""


def _digest(body: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(body.encode()).digest()).decode() + "'"


POLICY = (f"default-src 'none'; script-src {_digest(SCRIPT)}; style-src {_digest(STYLE)}; "
          "connect-src 'self'; img-src 'self'; base-uri 'none'; form-action 'none'; "
          "frame-ancestors 'none'")
