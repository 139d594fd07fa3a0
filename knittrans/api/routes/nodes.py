"""Node routes: register, heartbeat, list, declare lost."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from knittrans.api.auth import AdminAuth, WorkerAuth
from knittrans.api.models import NodeLostIn, NodePublic, NodeRegister, NodeUsageIn
from knittrans.api.routes.deps import Run, Service

__all__ = ["router"]

router = APIRouter(prefix="/v1/nodes", tags=["nodes"])


@router.post("", response_model=NodePublic)
async def register(body: NodeRegister, svc: Service, run: Run, _: WorkerAuth, request: Request) -> dict[str, Any]:
    """Register a store node, or register it again (back after being lost, or moved).

    Moving a node to a new endpoint needs the node's own ``node_key`` (bound at its first
    registration) or the admin token.
    """
    admin = request.app.state.tokens.is_admin(request)
    return await run(svc.register_node, body.node_id, body.endpoint, body.host, node_key=body.node_key, admin=admin)


@router.get("", response_model=list[NodePublic])
async def list_nodes(svc: Service, run: Run, _: WorkerAuth) -> list[dict[str, Any]]:
    """Every node with its state (nodes past their heartbeat timeout are declared lost first)."""
    return await run(svc.list_nodes)


@router.post("/{node}/heartbeat", response_model=NodePublic)
async def heartbeat(
    node: str, svc: Service, _: WorkerAuth, request: Request, body: NodeUsageIn | None = None
) -> dict[str, Any]:
    """Keep a node alive (optionally with its store usage); a lost node gets 409 and must register again."""
    result = svc.heartbeat(node)  # on the event loop: never waits behind admission on the state thread
    if body is not None:
        request.app.state.observed.record_store(node, body.model_dump(), time.time())
    return result


@router.post("/{node}/lost", response_model=NodePublic)
async def lost(node: str, svc: Service, run: Run, _: AdminAuth, body: NodeLostIn | None = None) -> dict[str, Any]:
    """Declare a node lost: its unadmitted groups are dropped, untouched mini-batches with its rows re-planned."""
    return await run(svc.declare_lost, node, (body or NodeLostIn()).reason)
