from sciproto.cli import app

app(prog_name="sciproto")
