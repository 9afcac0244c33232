// The app's Node.js part: the npm package the recipe installed.
console.log("node: " + require("kiln-hello"));
