"""gearshift: distributed PyTorch training on Ray that shifts the model's layout while it trains."""
