"""A router that looks only at the routes a path can match.

Starlette's router tries every route in order (a regular expression each): with ninety routes,
the worker API's were tried after some fifty others on every request. Here each route is filed
under its literal prefix: the path segments before its first parameter, at most :data:`DEPTH`
of them. A route can only match a path that starts with its prefix, so a request's candidates are
the routes filed under the prefixes of its own path, in the original order: the first full match
among them is the one a linear scan finds, and the first partial match (405) likewise. Anything
else (a redirect for a trailing slash, a 404) is left to the linear scan itself."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from starlette.routing import BaseRoute, Match, Router
from starlette.types import Receive, Scope, Send

DEPTH = 4  # literal segments a route is filed under, at most
MEMO = 4096  # request prefixes whose candidates are remembered (paths hold ids: bounded)


def _segments(path: str) -> tuple[str, ...]:
    return tuple(path.split("/", DEPTH + 1)[1:DEPTH + 1])


class IndexedRouter(Router):
    def __init__(self, routes: Sequence[BaseRoute], **kwargs: Any) -> None:
        super().__init__(routes, **kwargs)
        self._filed: dict[tuple[str, ...], list[int]] = {}
        for i, route in enumerate(self.routes):
            path = getattr(route, "path", None)
            prefix: tuple[str, ...] = ()
            if isinstance(path, str):
                for segment in _segments(path):
                    if "{" in segment:
                        break
                    prefix += (segment,)
            self._filed.setdefault(prefix, []).append(i)
        self._memo: dict[tuple[str, ...], list[BaseRoute]] = {}

    def candidates(self, path: str) -> list[BaseRoute]:
        """The routes that may match ``path``, in their order."""
        segments = _segments(path)
        found = self._memo.get(segments)
        if found is None:
            indexes = [i for n in range(len(segments) + 1) for i in self._filed.get(segments[:n], ())]
            found = [self.routes[i] for i in sorted(indexes)]
            if len(self._memo) < MEMO:
                self._memo[segments] = found
        return found

    async def app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("root_path"):  # (a root path: the linear scan strips it)
            await super().app(scope, receive, send)
            return
        scope.setdefault("router", self)
        partial = partial_scope = None
        for route in self.candidates(scope["path"]):
            match, child_scope = route.matches(scope)
            if match is Match.FULL:
                scope["route"] = route
                scope.update(child_scope)
                await route.handle(scope, receive, send)
                return
            if match is Match.PARTIAL and partial is None:
                partial, partial_scope = route, child_scope
        if partial is not None and partial_scope is not None:
            scope["route"] = partial
            scope.update(partial_scope)
            await partial.handle(scope, receive, send)
            return
        await super().app(scope, receive, send)  # no candidate matches: a redirect or a 404
