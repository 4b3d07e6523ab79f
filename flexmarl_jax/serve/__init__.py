"""Serving and chatting with the agents of a finished `flexmarl train` run.

`served_agent` loads one agent's policy from a run's checkpoints and builds a `FlexEngine` whose shapes
JetStream's Driver accepts; `request_checks` says which gRPC `DecodeRequest`s that engine can serve;
`servicer` is JetStream's `LLMOrchestrator` with those checks in front of the Driver; `server` runs Drivers
and a gRPC server per agent until SIGINT/SIGTERM (`flexmarl serve`); `chat` answers questions in process
with one agent or the whole team's workflow (`flexmarl chat`). docs/serving.md describes them.

Nothing here is imported by training; `servicer` and `server` import JetStream's orchestrator on first use.
"""
