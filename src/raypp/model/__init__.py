"""Model code: layers, the Llama-family stage model, weight loading."""
