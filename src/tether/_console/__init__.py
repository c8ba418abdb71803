"""``tether console``: a small web console served on loopback (Starlette, server-sent events)."""
