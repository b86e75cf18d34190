"""The serving runtime: config, protocol, loader, model, runner, scheduler, processes."""
