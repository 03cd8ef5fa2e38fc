"""Link geometry of ComfyUI's graph editor, and a router that keeps links off nodes and group titles.

The frontends (1.32 and 1.49) draw every link as a cubic Bezier curve from an output slot (leaving to the right) to
an input slot (arriving from the left), the control points a quarter of the endpoints' distance out. Through the
native reroutes of a link (`extra.reroutes`, `extra.linkExtensions` in the saved file) it is drawn piece by piece:
each reroute's tangent bisects the directions to its neighbours, its control points at most REROUTE_MAX_OFFSET
out. `link_points` reproduces that; tests/browser/check_workflows.mjs checks it against the paths the frontend
really drew and then checks those against the nodes and group titles.

`route` finds, for a link whose direct curve would cross a node or a group's title bar, a path of horizontal and
vertical runs through the free space (A* on a grid, turns cost extra) and returns its corners, where reroutes go.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from typing import NamedTuple

Point = tuple[float, float]

SPLINE_FACTOR = 0.25  # control point distance / endpoint distance
REROUTE_MAX_OFFSET = 20  # how far a reroute's control points reach, measured in frontend 1.49
CURVE_SAMPLES = 48  # per piece
GRID = 8  # router cell, canvas units
TURN_COST = 12  # in cells: a turn costs as much as this many steps
NEAR_COST = 0.6  # per step next to an obstacle, so runs keep a cell of space where they can
CLEARANCE = 16  # how far a routed run keeps from nodes and titles
SOCKET_RUN = 40  # the straight piece a routed link starts and ends with


class Box(NamedTuple):
    x: float
    y: float
    w: float
    h: float

    def inflate(self, by: float) -> Box:
        return Box(self.x - by, self.y - by, self.w + 2 * by, self.h + 2 * by)

    def contains(self, p: Point) -> bool:
        return self.x <= p[0] <= self.x + self.w and self.y <= p[1] <= self.y + self.h

    def overlaps(self, other: Box) -> bool:
        return (
            self.x < other.x + other.w
            and other.x < self.x + self.w
            and self.y < other.y + other.h
            and other.y < self.y + self.h
        )


def _bezier(p0: Point, c0: Point, c1: Point, p1: Point, samples: int = CURVE_SAMPLES) -> list[Point]:
    points = []
    for i in range(samples + 1):
        t = i / samples
        u = 1 - t
        a, b, c, d = u * u * u, 3 * u * u * t, 3 * u * t * t, t * t * t
        points.append((a * p0[0] + b * c0[0] + c * c1[0] + d * p1[0], a * p0[1] + b * c0[1] + c * c1[1] + d * p1[1]))
    return points


def _distance(a: Point, b: Point) -> float:
    return math.hypot(b[0] - a[0], b[1] - a[1])


def link_points(start: Point, end: Point, reroutes: Sequence[Point] = ()) -> list[Point]:
    """Points along a link as the frontend draws it: from an output slot at `start` to an input slot at `end`
    through `reroutes` (each carrying this link only)."""
    chain = [start, *reroutes, end]
    # Each reroute's unit tangent: the bisector of the direction it is entered from and the one it leaves in.
    tangents = []
    for i in range(1, len(chain) - 1):
        previous, here, following = chain[i - 1], chain[i], chain[i + 1]
        entering = math.atan2(here[1] - previous[1], here[0] - previous[0])
        leaving = math.atan2(following[1] - here[1], following[0] - here[0])
        half = (entering - leaving) * 0.5
        if abs(half) > math.pi * 0.5:
            half += math.pi
        angle = entering - half
        tangents.append((math.cos(angle), math.sin(angle)))
    points: list[Point] = []
    for i in range(len(chain) - 1):
        a, b = chain[i], chain[i + 1]
        span = _distance(a, b)
        if i == 0:
            c0 = (a[0] + span * SPLINE_FACTOR, a[1])
        else:
            reach = min(REROUTE_MAX_OFFSET, span * SPLINE_FACTOR)
            cos, sin = tangents[i - 1]
            c0 = (a[0] + reach * cos, a[1] + reach * sin)
        if i == len(chain) - 2:
            c1 = (b[0] - span * SPLINE_FACTOR, b[1])
        else:
            reach = min(REROUTE_MAX_OFFSET, span * SPLINE_FACTOR)
            cos, sin = tangents[i]
            c1 = (b[0] - reach * cos, b[1] - reach * sin)
        piece = _bezier(a, c0, c1, b)
        points.extend(piece if i == 0 else piece[1:])
    return points


def crossings(points: Iterable[Point], obstacles: dict[str, Box], skip_near: Sequence[Point] = (), near: float = 0.0):
    """Names of the obstacles the points fall into; points within `near` of one of `skip_near` are not counted."""
    hit = []
    for name, box in obstacles.items():
        for p in points:
            if any(_distance(p, q) < near for q in skip_near):
                continue
            if box.contains(p):
                hit.append(name)
                break
    return hit


class Router:
    """A* over a grid of the page; cells inside an (inflated) obstacle are blocked."""

    def __init__(self, bounds: Box, obstacles: Iterable[Box]):
        self.x0, self.y0 = bounds.x, bounds.y
        self.cols = math.ceil(bounds.w / GRID) + 1
        self.rows = math.ceil(bounds.h / GRID) + 1
        self.blocked = [[False] * self.cols for _ in range(self.rows)]
        self.near = [[False] * self.cols for _ in range(self.rows)]
        for box in obstacles:
            self._mark(box.inflate(CLEARANCE), self.blocked)
            self._mark(box.inflate(CLEARANCE + GRID), self.near)

    def _mark(self, box: Box, grid: list[list[bool]]) -> None:
        # The cells whose centres lie in the box.
        c0 = max(0, math.ceil((box.x - self.x0) / GRID))
        c1 = min(self.cols - 1, math.floor((box.x + box.w - self.x0) / GRID))
        r0 = max(0, math.ceil((box.y - self.y0) / GRID))
        r1 = min(self.rows - 1, math.floor((box.y + box.h - self.y0) / GRID))
        for r in range(r0, r1 + 1):
            row = grid[r]
            for c in range(c0, c1 + 1):
                row[c] = True

    def _cell(self, p: Point) -> tuple[int, int]:
        return (round((p[1] - self.y0) / GRID), round((p[0] - self.x0) / GRID))

    def _point(self, cell: tuple[int, int]) -> Point:
        return (self.x0 + cell[1] * GRID, self.y0 + cell[0] * GRID)

    def route(self, start: Point, end: Point) -> list[Point] | None:
        """Corners of a run of horizontal and vertical pieces from just right of `start` to just left of `end`,
        first and last piece horizontal at the slots' heights; None when there is no way through."""
        first = self._cell((start[0] + SOCKET_RUN, start[1]))
        last = self._cell((end[0] - SOCKET_RUN, end[1]))
        for r, c in (first, last):
            if not (0 <= r < self.rows and 0 <= c < self.cols) or self.blocked[r][c]:
                return None
        moves = ((0, 1), (1, 0), (0, -1), (-1, 0))
        # State: cell and the move that reached it (index into moves); the run leaves the output going right.
        start_state = (first, 0)
        best = {start_state: 0.0}
        came: dict = {}
        queue = [(0.0, 0.0, start_state)]
        goal = None
        while queue:
            _f, cost, state = heapq.heappop(queue)
            if cost > best.get(state, math.inf):
                continue
            cell, heading = state
            if cell == last and heading == 0:
                goal = state
                break
            for turn, (dr, dc) in enumerate(moves):
                if (turn + 2) % 4 == heading:
                    continue
                r, c = cell[0] + dr, cell[1] + dc
                if not (0 <= r < self.rows and 0 <= c < self.cols) or self.blocked[r][c]:
                    continue
                step = 1.0 + (NEAR_COST if self.near[r][c] else 0.0) + (TURN_COST if turn != heading else 0.0)
                new = ((r, c), turn)
                new_cost = cost + step
                if new_cost < best.get(new, math.inf):
                    best[new] = new_cost
                    came[new] = state
                    estimate = abs(r - last[0]) + abs(c - last[1]) + (TURN_COST if turn != 0 else 0)
                    heapq.heappush(queue, (new_cost + estimate, new_cost, new))
        if goal is None:
            return None
        cells = [goal[0]]
        state = goal
        while state in came:
            state = came[state]
            cells.append(state[0])
        cells.reverse()
        # The run enters the first cell and leaves the last one going right.
        cells = [(first[0], first[1] - 1), *cells, (last[0], last[1] + 1)]
        corners = []
        for i in range(1, len(cells) - 1):
            before, here, after = cells[i - 1], cells[i], cells[i + 1]
            if (here[0] - before[0], here[1] - before[1]) != (after[0] - here[0], after[1] - here[1]):
                corners.append(self._point(here))
        # The first and last runs are horizontal: put their corners at the slots' own heights.
        if corners:
            corners[0] = (corners[0][0], start[1])
            corners[-1] = (corners[-1][0], end[1])
        return corners
