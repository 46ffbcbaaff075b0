"""Write and read benchmark results: the one JSON writer, markdown tables, plots, machine facts."""
