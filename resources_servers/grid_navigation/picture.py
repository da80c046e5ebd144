"""The grid as a small picture: what `look` shows a vision model when the server is configured to."""

from __future__ import annotations

import base64
import io

from resources_servers.grid_navigation.world import Walker

CELL_PIXELS = 14
COLOURS = {"floor": (235, 235, 235), "wall": (40, 40, 40), "goal": (40, 180, 60), "walker": (40, 80, 220)}
ITEM_COLOUR = (230, 190, 30)


def grid_picture_url(walker: Walker) -> str:
    """A PNG data URL of the walker's grid, CELL_PIXELS per cell: walls dark, the goal green, items yellow, the
    walker blue (drawn last, over whatever cell it stands on)."""
    from PIL import Image

    grid = walker.grid
    side = grid.size * CELL_PIXELS
    image = Image.new("RGB", (side, side), COLOURS["floor"])
    painted = [(wall, COLOURS["wall"]) for wall in grid.walls]
    painted += [(grid.goal, COLOURS["goal"])] + [(cell, ITEM_COLOUR) for cell in walker.items_left.values()]
    painted.append((walker.position, COLOURS["walker"]))
    for (row, column), colour in painted:
        left, top = column * CELL_PIXELS, row * CELL_PIXELS
        image.paste(colour, (left, top, left + CELL_PIXELS, top + CELL_PIXELS))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
