"""Command-line jobs composing gm_graphs and gm_solver: build, graphs, generate, demo."""
