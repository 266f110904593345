// Builds src/plugin.js into a kvplane `backend` component with
// componentize-js, offline (everything comes from node_modules).
//
//   node build.mjs [--wit DIR] [--out FILE]
//
// --wit: the contract (default: the repository's wit/, ../../../wit);
// --out: the component (default: js-resp.wasm here). The equivalent CLI call:
//   npx componentize-js --wit ../../../wit --world-name backend \
//       --disable http fetch-event -o js-resp.wasm src/plugin.js
import { writeFile } from 'node:fs/promises';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

const here = dirname(fileURLToPath(import.meta.url));
let componentize;
try {
  ({ componentize } = await import('@bytecodealliance/componentize-js'));
} catch (e) {
  console.error(`componentize-js is not installed in ${join(here, 'node_modules')}: %s\n(${e.message})`, 'run `npm ci` here (or `scripts/prereqs js` from the repository root)');
  process.exit(1);
}
const { values } = parseArgs({
  options: {
    wit: { type: 'string', default: join(here, '..', '..', '..', 'wit') },
    out: { type: 'string', short: 'o', default: join(here, 'js-resp.wasm') },
  },
});
const wit = resolve(values.wit);
const out = resolve(values.out);

// componentize-js maps the working directory into the build when the source
// lies under it, so src/plugin.js can import ./resp.js.
process.chdir(here);
const started = performance.now();
try {
  const { component } = await componentize({
    sourcePath: join(here, 'src', 'plugin.js'),
    witPath: wit,
    worldName: 'backend',
    // The host links no wasi:http; the plugin needs neither fetch nor a
    // fetch event. stdio (error reports), clocks and random stay: the host
    // links them, empty (clocks read zero, randomness is a fixed sequence).
    disableFeatures: ['http', 'fetch-event'],
  });
  await writeFile(out, component);
  const seconds = ((performance.now() - started) / 1000).toFixed(1);
  console.log(`built ${out}: ${component.length} bytes in ${seconds} s (componentize-js, world backend of ${wit})`);
} catch (e) {
  console.error(`componentize-js failed to build src/plugin.js against ${wit}:\n${e && e.stack ? e.stack : e}`);
  process.exit(1);
}
