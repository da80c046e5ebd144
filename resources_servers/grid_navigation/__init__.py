"""grid_navigation: walk a small grid with move/look/pick_up tools to reach a goal cell."""
