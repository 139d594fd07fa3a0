"""Token routes: an admin mints scoped bearer tokens (one job's worker, one rank, a store node)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from knittrans.api.auth import AdminAuth, Scope, mint_token
from knittrans.api.models import TokenIn, TokenOut
from knittrans.errors import Conflict

__all__ = ["router"]

router = APIRouter(prefix="/v1/tokens", tags=["tokens"])


@router.post("", response_model=TokenOut)
async def mint(body: TokenIn, request: Request, _: AdminAuth) -> dict[str, Any]:
    """A bearer token limited to one role: ``worker`` of a job, ``rank`` (a job's trainer: rank r only
    when ``rank`` is given, else every rank, as rank 0 of a collective group reports), or ``store``.

    Needs an admin token configured (it is the key the scoped tokens are signed with): 409 otherwise.
    """
    secret = request.app.state.tokens.admin
    if secret is None:
        raise Conflict("scoped tokens need an admin token on the control plane (it signs them)")
    scope = Scope(role=body.role, job=body.job if body.role != "store" else None, rank=body.rank)
    return {"token": mint_token(secret, scope), "role": scope.role, "job": scope.job, "rank": scope.rank}
