#!/usr/bin/env python3
"""Reads a PNG (8-bit RGB or RGBA, not interlaced: what headless Chromium writes) with zlib and
struct only, and prints what the timeline test asserts on, as JSON:

  png_lanes.py SHOT.png COLOR_NAME=#rrggbb ...

- "lanes": for each COLOR_NAME, the vertical runs [top, bottom] of that colour in the column of
  the lane markers left of each lane (launcher/timeline.h's timeline_colors): the middle of the
  first colour's leftmost run of 6 pixels or more in a row within the 80 leftmost columns;
- "groups": for each run of the first colour (a node lane: its group of lanes reaches to the next
  node lane) and each colour, in the group's rows right of the lane labels (CHART_DX pixels
  right of the markers): "runs", the most separate horizontal runs of that colour in one row
  (a vertical line crossing the group is one run in every row), and "longest", the longest run
  (a bar's length; text inside a bar splits it into several runs).
A pixel matches a colour when each channel is within 8 of it (anti-aliasing never reaches the
inside of a crisp-edged rectangle; the tolerance only absorbs colour conversion).
"""
import json
import struct
import sys
import zlib

CHART_DX = 290  # the chart starts 300 px right of the SVG's left edge, the markers 4..14


def read_png(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise SystemExit(f"{path}: not a PNG")
    pos, idat, width = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or ctype not in (2, 6) or interlace != 0:
                raise SystemExit(f"{path}: unsupported PNG (depth {depth}, type {ctype})")
            bpp = 3 if ctype == 2 else 4
        elif kind == b"IDAT":
            idat += body
        elif kind == b"IEND":
            break
    raw = zlib.decompress(idat)
    stride = width * bpp
    rows, prev, i = [], bytearray(stride), 0
    for _ in range(height):
        ftype = raw[i]
        line = bytearray(raw[i + 1:i + 1 + stride])
        i += 1 + stride
        for x in range(stride):
            a = line[x - bpp] if x >= bpp else 0
            b = prev[x]
            c = prev[x - bpp] if x >= bpp else 0
            if ftype == 1:
                line[x] = (line[x] + a) & 255
            elif ftype == 2:
                line[x] = (line[x] + b) & 255
            elif ftype == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif ftype == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pr = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[x] = (line[x] + pr) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, bpp, rows


def main():
    path = sys.argv[1]
    colors = []
    for arg in sys.argv[2:]:
        name, hexc = arg.split("=")
        colors.append((name, tuple(int(hexc[k:k + 2], 16) for k in (1, 3, 5))))
    width, height, bpp, rows = read_png(path)

    def match(y, x, rgb):
        p = rows[y][x * bpp:x * bpp + 3]
        return all(abs(p[k] - rgb[k]) <= 8 for k in range(3))

    marker_x = None
    for y in range(height):
        run = 0
        for x in range(min(80, width)):
            run = run + 1 if match(y, x, colors[0][1]) else 0
            if run >= 6:
                marker_x = x - 2
                break
        if marker_x is not None:
            break
    if marker_x is None:
        print(json.dumps({"width": width, "height": height, "marker_x": None, "lanes": {}, "groups": []}))
        return
    lanes = {}
    for name, rgb in colors:
        runs, start = [], None
        for y in range(height):
            if match(y, marker_x, rgb):
                if start is None:
                    start = y
            elif start is not None:
                runs.append([start, y - 1])
                start = None
        if start is not None:
            runs.append([start, height - 1])
        lanes[name] = runs
    groups = []
    node_runs = lanes[colors[0][0]]
    for g, (top, _) in enumerate(node_runs):
        bottom = node_runs[g + 1][0] - 1 if g + 1 < len(node_runs) else height - 1
        if g + 1 == len(node_runs) and len(colors) > 1:
            below = [r[1] for name, _ in colors[1:] for r in lanes[name] if r[0] > top]
            bottom = max(below) if below else bottom
        info = {"top": top, "bottom": bottom}
        for name, rgb in colors:
            most, longest = 0, 0
            for y in range(top, bottom + 1):
                n, run = 0, 0
                for x in range(marker_x + CHART_DX, width):
                    if match(y, x, rgb):
                        if run == 0:
                            n += 1
                        run += 1
                        longest = max(longest, run)
                    else:
                        run = 0
                most = max(most, n)
            info[name] = {"runs": most, "longest": longest}
        groups.append(info)
    print(json.dumps({"width": width, "height": height, "marker_x": marker_x, "lanes": lanes,
                      "groups": groups}))


main()
