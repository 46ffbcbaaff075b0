"""The live comparison: both modes on one port, the page and its event stream."""
