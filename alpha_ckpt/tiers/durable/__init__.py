"""Publishers: how the owners' captures of one update boundary become one generation."""
