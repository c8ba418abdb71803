"""What a chaos trial's `tether worker` runs: ``--agents tether._chaos.agents:AGENTS``.

Built at import from the trial's folder and plan in the environment (``TETHER_CHAOS_DIR``,
``TETHER_CHAOS_PLAN``), so the worker runs the same agent, tools and probes as the
orchestrator that queued the work."""

from __future__ import annotations

from tether._chaos.world import Trial, build

TRIAL = Trial.from_env("worker")
REFUND, LOOKUP, AGENT = build(TRIAL)
AGENTS = [AGENT]
