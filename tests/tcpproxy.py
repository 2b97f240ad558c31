"Forward TCP connections from 127.0.0.1:PORT to 127.0.0.1:TARGET (`python tcpproxy.py PORT TARGET`); kill it and the server is unreachable."
import asyncio, sys

async def _pipe(r, w):
    try:
        while data := await r.read(1 << 16):
            w.write(data)
            await w.drain()
    except OSError: pass
    finally: w.close()

async def _handle(r, w, target):
    try: tr,tw = await asyncio.open_connection('127.0.0.1', target)
    except OSError:
        w.close()
        return
    await asyncio.gather(_pipe(r, tw), _pipe(tr, w))

async def main(port, target):
    server = await asyncio.start_server(lambda r, w: _handle(r, w, target), '127.0.0.1', port, reuse_address=True)
    print('READY', flush=True)
    async with server: await server.serve_forever()

if __name__ == '__main__': asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
