"""The grid world: a row's grid (validated) and the walker that moves on it, free of any HTTP concern."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Cell = tuple[int, int]
"""[row, column]; row 0 is the north edge, column 0 the west edge."""

DIRECTIONS: dict[str, Cell] = {"north": (-1, 0), "south": (1, 0), "east": (0, 1), "west": (0, -1)}


class Grid(BaseModel):
    """A row's `grid` field."""

    model_config = ConfigDict(extra="forbid")

    size: int = Field(ge=2, le=10)
    start: Cell
    goal: Cell
    walls: list[Cell] = []
    items: dict[Literal["key", "coin"], Cell] = {}
    requires_key: bool = False
    """The goal counts only while holding the key."""

    @model_validator(mode="after")
    def _consistent(self) -> Grid:
        named = [("start", self.start), ("goal", self.goal), *((f"items.{k}", c) for k, c in self.items.items())]
        for name, cell in [*named, *(("walls", wall) for wall in self.walls)]:
            if not all(0 <= v < self.size for v in cell):
                raise ValueError(f"{name} {list(cell)} is outside the {self.size}x{self.size} grid")
            if name != "walls" and cell in self.walls:
                raise ValueError(f"{name} {list(cell)} is on a wall")
        if self.requires_key and "key" not in self.items:
            raise ValueError("requires_key is true but items has no key")
        return self

    def obstacle(self, cell: Cell) -> str | None:
        """What stops a walker from entering `cell`, or None."""
        if not all(0 <= v < self.size for v in cell):
            return "the edge of the grid"
        return f"a wall at {list(cell)}" if cell in self.walls else None


@dataclass
class Walker:
    """One episode's state; `move`, `look` and `pick_up` are the tools, called with arguments already checked."""

    grid: Grid
    position: Cell
    items_left: dict[str, Cell]
    held: list[str] = field(default_factory=list)
    moves: int = 0

    def distance_to_goal(self) -> int:
        return abs(self.position[0] - self.grid.goal[0]) + abs(self.position[1] - self.grid.goal[1])

    def move(self, direction: str, steps: int) -> str:
        self.moves += 1
        (d_row, d_col), moved, blocker = DIRECTIONS[direction], 0, None
        while moved < steps:
            ahead = (self.position[0] + d_row, self.position[1] + d_col)
            if blocker := self.grid.obstacle(ahead):
                break
            self.position, moved = ahead, moved + 1
        text = f"moved {moved} of {steps} {direction}; now at {list(self.position)}"
        text += f"; stopped by {blocker}" if blocker else ""
        return text + ("; you are on the goal" if self.distance_to_goal() == 0 else "")

    def look(self) -> str:
        row, col = self.position
        blocked = [
            f"{name} ({why})"
            for name, (d_row, d_col) in DIRECTIONS.items()
            if (why := self.grid.obstacle((row + d_row, col + d_col)))
        ]
        return "; ".join(
            [
                f"you are at {[row, col]}",
                f"the goal is at {list(self.grid.goal)}" + (" and needs the key" if self.grid.requires_key else ""),
                f"blocked: {', '.join(blocked) or 'nothing'}",
                f"items: {', '.join(f'{item} at {list(cell)}' for item, cell in self.items_left.items()) or 'none'}",
                f"holding: {', '.join(self.held) or 'nothing'}",
            ]
        )

    def pick_up(self, item: str) -> str:
        if item in self.held:
            return f"you already hold the {item}"
        if item not in self.items_left:
            return f"there is no {item} on this grid"
        if self.items_left[item] != self.position:
            return f"there is no {item} at {list(self.position)}; look() tells where items are"
        del self.items_left[item]
        self.held.append(item)
        return f"picked up the {item}"
