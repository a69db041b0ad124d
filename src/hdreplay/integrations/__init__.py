"""Framework adapters. Each is import-guarded and never imported by the core package."""
