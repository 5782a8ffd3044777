"""What only notebooks use: Drive mounting, the recipe picker, tables, the live loss plot, downloads."""
