"""The engine, one module per stage of a step: schedule -> run the model -> sample -> update."""
