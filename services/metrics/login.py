"""The dashboard's login: a token typed once, kept in a cookie the browser sends back.

A browser's EventSource cannot send an Authorization header, so the dashboard keeps the
caller's bearer token (a service-account token, or whatever the cluster's authenticators
accept: `kubectl create token NAME`) in an HttpOnly, SameSite=Strict cookie, checked with the
API server on every request exactly like the header. Scripts and `vgpu inspect` send the
header instead. The cookie lives as long as the browser session, at most MAX_AGE_S.
"""

from __future__ import annotations

import html

from aiohttp import web

from services.common.kube_auth import COOKIE, MAX_TOKEN_BYTES, AuthError, Gate, refused

MAX_AGE_S = 8 * 3600

PAGE = """<!doctype html>
<html lang="en">
<head><meta charset="utf-8"><title>vgpu — sign in</title>
<link rel="icon" href="data:,"><link rel="stylesheet" href="/static/dashboard.css"></head>
<body><main class="login">
<h1>vgpu</h1>
<form method="post" action="/login">
<p>Paste a Kubernetes bearer token (e.g. <code>kubectl create token NAME</code>, or the
admin token <code>vgpu up</code> printed). You will see the namespaces whose pods it may
list.</p>
<p class="error" role="alert">{error}</p>
<label>Token <input type="password" name="token" autocomplete="off" required
 maxlength="{max_bytes}" autofocus></label>
<button type="submit">Sign in</button>
</form></main></body></html>
"""


def login_page(error: str = "", status: int = 200) -> web.Response:
    body = PAGE.format(error=html.escape(error), max_bytes=MAX_TOKEN_BYTES)
    return web.Response(text=body, status=status, content_type="text/html",
                        headers={"Cache-Control": "no-store"})  # fmt: skip


def login_routes(gate: Gate) -> list[web.RouteDef]:
    async def show(request: web.Request) -> web.Response:
        return login_page()

    async def login(request: web.Request) -> web.Response:
        form = await request.post()
        token = str(form.get("token") or "").strip()
        if not token or len(token) > MAX_TOKEN_BYTES:
            return login_page("Paste a token.", status=400)
        try:
            caller = await gate.authenticate(token)
        except AuthError as exc:
            refused(gate, request, exc)
            return login_page(exc.reason, status=exc.status)
        response = web.Response(status=303, headers={"Location": "/"})
        response.set_cookie(COOKIE, token, max_age=MAX_AGE_S, httponly=True, samesite="Strict",
                            secure=request.secure, path="/")  # fmt: skip
        response.headers["X-Vgpu-User"] = caller.username
        return response

    async def logout(request: web.Request) -> web.Response:
        response = web.Response(status=303, headers={"Location": "/login"})
        response.del_cookie(COOKIE, path="/")
        return response

    return [web.get("/login", show), web.post("/login", login), web.post("/logout", logout)]
