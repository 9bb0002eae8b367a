"""Plans to text, tables, JSON and SVG. Formats; never computes."""
